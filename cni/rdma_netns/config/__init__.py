"""Network configuration: the pydantic contract (model.py), its fast, cached loader (loader.py),
the typed config every call reads (netconf.py, no pydantic) and every default (defaults.py,
importing nothing). Modules here may import spec/, util/ and kernel/inet.py (address parsing);
nothing of the layers that read a config (commands/, modes/, grants/, rails/, publish/).
"""
