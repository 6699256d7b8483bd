"""Network configuration: the pydantic contract (model.py) and its fast, cached loader."""
