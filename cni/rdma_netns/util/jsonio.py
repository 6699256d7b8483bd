"""JSON for the hot path, on CPython's C accelerator `_json`.

`import json` costs about 10 ms here (it compiles several regular expressions at import), which
would be a third of an ADD. The C scanner and encoder that `json` itself uses are enough for
the plugin's needs; where `_json` is missing (another Python), the standard module is used.
"""

from __future__ import annotations

try:
    import _json
except ImportError:  # pragma: no cover - other Python implementations
    _json = None


class _DecoderContext:
    """The attributes `_json.make_scanner` reads from a json.JSONDecoder."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.__getitem__
    memo: dict = {}


def _not_serialisable(value: object) -> object:
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


if _json is not None:
    _scan = _json.make_scanner(_DecoderContext())
    _encode = _json.make_encoder(None, _not_serialisable, _json.encode_basestring_ascii, None, ": ", ", ",
                                 False, False, True)
    _WHITESPACE = " \t\n\r"

    def loads(text: str | bytes) -> object:
        """Parse one JSON document; ValueError (as json.loads) on anything else."""
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8")
        start = len(text) - len(text.lstrip(_WHITESPACE))
        try:
            value, end = _scan(text, start)
            if text[end:].strip(_WHITESPACE):
                raise ValueError("extra data")
        except Exception:
            # Error path only: the C scanner's error reporting needs the json package, so let the
            # standard module produce its precise JSONDecodeError (a ValueError).
            import json

            return json.loads(text)
        finally:
            _DecoderContext.memo.clear()
        return value

    def dumps(value: object) -> str:
        return "".join(_encode(value, 0))

else:  # pragma: no cover
    import json

    loads = json.loads

    def dumps(value: object) -> str:
        return json.dumps(value)
