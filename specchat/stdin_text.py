"""Text from standard input whatever bytes arrive: invalid UTF-8 is replaced (U+FFFD), and said once
on stderr, instead of reaching the tokenizer as lone surrogates and failing there."""
from __future__ import annotations

import sys
from typing import BinaryIO, Iterator, Optional, TextIO


class StdinText:
    def __init__(self, raw: Optional[BinaryIO] = None, err: Optional[TextIO] = None):
        # a text stream without bytes underneath (a test's StringIO) is read as it is
        self.raw = raw if raw is not None else getattr(sys.stdin, "buffer", sys.stdin)
        self.err = err if err is not None else sys.stderr
        self.replaced = False

    def _decode(self, data: bytes | str) -> str:
        if isinstance(data, str):
            return data
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("utf-8", errors="replace")
        if not self.replaced:
            self.replaced = True
            self.err.write("specchat: note: standard input is not valid UTF-8; the bytes that are not were "
                           "replaced with \ufffd\n")
            self.err.flush()
        return text

    def read(self) -> str:
        return self._decode(self.raw.read())

    def lines(self) -> Iterator[str]:
        """Lines without their line ending, as they arrive (a pipe is read as it is written)."""
        for line in self.raw:
            yield self._decode(line).rstrip("\r\n")
