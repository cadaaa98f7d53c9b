"""One forwarded math-library call's number, payload fields and kind (see ``cuda_libs``); a leaf, so each
library's module (``lib_cublas``, ``lib_cublaslt``, ``lib_cudnn``) imports it in any order."""
from __future__ import annotations

import struct
from dataclasses import dataclass

# struct code -> C type of a payload field (the generated header's structs)
C_TYPES = {"Q": "uint64_t", "q": "int64_t", "I": "uint32_t", "i": "int32_t", "d": "double", "f": "float"}


@dataclass(frozen=True)
class LibCall:
    id: int
    name: str                          # the library function it forwards: what an error names
    fields: tuple[tuple[str, str], ...] = ()   # (field, struct code); "16s" a 16-byte field (a scalar, an algo)
    sync: bool = False                 # answered (its caller needs the output), else queued

    @property
    def format(self) -> struct.Struct:
        return struct.Struct("<" + "".join(code for _, code in self.fields))

    def c_struct(self) -> str:
        """The payload's fixed part as a packed C struct."""
        lines = []
        for name, code in self.fields:
            if code.endswith("s"):
                lines.append(f"    uint8_t {name}[{int(code[:-1])}];")
            else:
                lines.append(f"    {C_TYPES[code]} {name};")
        body = "\n".join(lines) if lines else "    uint8_t _none;"   # C has no empty structs
        return f"typedef struct __attribute__((packed)) {{\n{body}\n}} rgpu_lib_{self.name}_t;"
