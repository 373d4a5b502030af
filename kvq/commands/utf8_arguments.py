"""Text given on the command line must be UTF-8: Python keeps other bytes as lone surrogates
(`surrogateescape`), which a tokenizer cannot take. Refused here with the byte and where it is.
Imports kvq.errors only.
"""

from __future__ import annotations

from kvq.errors import KvqError

_ESCAPED = range(0xDC80, 0xDD00)  # surrogateescape maps byte b (>= 0x80) to U+DC00 + b


def check_utf8(text: str, what: str) -> str:
    """`text` if it is valid UTF-8 text, else a `KvqError` naming `what` and the first bad byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        byte = f"byte 0x{char - 0xDC00:02x}" if char in _ESCAPED else f"code point U+{char:04X}"
        raise KvqError(
            f"{what} is not valid UTF-8 ({byte} at character {e.start}); pass UTF-8 text (e.g. convert "
            "it with iconv)"
        ) from None
    return text
