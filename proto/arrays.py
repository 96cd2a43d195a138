"""Numeric arrays inside wire messages, carried as raw little-endian bytes.

A field annotated with one of the array types below holds a read-only
``numpy.ndarray`` in Python. It serialises to ``{"dtype", "shape", "data"}``:
``data`` is the raw bytes in Python mode (what the msgpack wire format carries,
no copy through text) and base64 in JSON mode (REST bodies, exported schemas).
A 64K-token trajectory's ids are 256 KiB instead of ~400 KiB of JSON digits.

Accepted inputs: an ndarray (cast to the field's dtype when lossless for
integers), a list of numbers, a CPU torch tensor, or the serialised dict.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any

import numpy as np
from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import PydanticCustomError, core_schema

__all__ = [
    "ArraySpec",
    "Float32Array",
    "Int32Array",
    "RoutedExpertsArray",
    "Uint8Array",
    "arrays_equal",
]


class ArraySpec:
    """Pydantic annotation: an ndarray with one of ``dtypes`` (the first is the default) and ``ndim`` dims."""

    def __init__(self, *dtypes: str, ndim: int = 1) -> None:
        self.dtypes = tuple(
            np.dtype(d).newbyteorder("<") if np.dtype(d).itemsize > 1 else np.dtype(d) for d in dtypes
        )
        self.names = tuple(np.dtype(d).name for d in dtypes)
        self.ndim = ndim

    # -- pydantic hooks -------------------------------------------------------------
    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            self.validate,
            serialization=core_schema.plain_serializer_function_ser_schema(self.serialize, info_arg=True),
        )

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict:
        dtype_schema: dict[str, Any] = (
            {"const": self.names[0]} if len(self.names) == 1 else {"enum": list(self.names)}
        )
        return {
            "type": "object",
            "description": f"{self.ndim}-D {'/'.join(self.names)} array: little-endian bytes, base64 in JSON",
            "properties": {
                "dtype": dtype_schema,
                "shape": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0},
                    "minItems": self.ndim,
                    "maxItems": self.ndim,
                },
                "data": {"type": "string", "contentEncoding": "base64"},
            },
            "required": ["dtype", "shape", "data"],
            "additionalProperties": False,
        }

    # -- conversion -----------------------------------------------------------------
    def validate(self, value: Any) -> np.ndarray:
        if isinstance(value, dict):
            arr = self._from_wire(value)
        else:
            if hasattr(value, "detach") and hasattr(value, "numpy"):  # torch.Tensor
                value = value.detach().cpu().numpy()
            arr = self._coerce(np.asarray(value) if not isinstance(value, np.ndarray) else value)
        if arr.ndim != self.ndim:
            raise PydanticCustomError(
                "array_ndim",
                "expected a {ndim}-D array, got shape {shape}",
                {"ndim": self.ndim, "shape": arr.shape},
            )
        # A read-only view: the message is frozen, and the caller's own array is left as it was.
        view = np.ascontiguousarray(arr).view()
        view.flags.writeable = False
        return view

    def _coerce(self, arr: np.ndarray) -> np.ndarray:
        if arr.dtype in self.dtypes:
            return arr
        if arr.size == 0:
            return arr.astype(self.dtypes[0])
        target = self.dtypes[0]
        if target.kind in "iu":
            if arr.dtype.kind not in "iub":
                raise PydanticCustomError(
                    "array_dtype",
                    "expected integers for a {dtype} array, got {got}",
                    {"dtype": target.name, "got": str(arr.dtype)},
                )
            info = np.iinfo(target)
            if arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise PydanticCustomError(
                    "array_range", "values do not fit in {dtype}", {"dtype": target.name}
                )
        elif arr.dtype.kind not in "fiub":
            raise PydanticCustomError(
                "array_dtype",
                "expected numbers for a {dtype} array, got {got}",
                {"dtype": target.name, "got": str(arr.dtype)},
            )
        return arr.astype(target)

    def _from_wire(self, value: dict) -> np.ndarray:
        if set(value) != {"dtype", "shape", "data"}:
            raise PydanticCustomError("array_wire", "an array needs exactly the keys dtype, shape and data")
        name, shape, data = value["dtype"], value["shape"], value["data"]
        if name not in self.names:
            raise PydanticCustomError(
                "array_dtype",
                "dtype {got} is not one of {allowed}",
                {"got": name, "allowed": list(self.names)},
            )
        if isinstance(data, str):
            try:
                data = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise PydanticCustomError(
                    "array_base64", "data is not valid base64: {err}", {"err": str(exc)}
                ) from None
        if not isinstance(data, bytes | bytearray | memoryview):
            raise PydanticCustomError("array_wire", "data must be bytes or a base64 string")
        if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise PydanticCustomError("array_wire", "shape must be a list of non-negative integers")
        dtype = self.dtypes[self.names.index(name)]
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if len(data) != expected:
            raise PydanticCustomError(
                "array_size",
                "data has {got} bytes but shape {shape} of {dtype} needs {want}",
                {"got": len(data), "shape": list(shape), "dtype": name, "want": expected},
            )
        return np.frombuffer(data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="), copy=False)

    def serialize(self, arr: np.ndarray, info: Any) -> dict[str, Any]:
        dtype = (
            self.dtypes[self.names.index(arr.dtype.name)] if arr.dtype.name in self.names else self.dtypes[0]
        )
        contiguous = np.ascontiguousarray(arr, dtype=dtype)
        if info.mode_is_json():
            data: Any = base64.b64encode(contiguous.tobytes()).decode("ascii")
        elif info.context is WIRE_CONTEXT and contiguous.nbytes > PIECE_BYTES:
            data = Pieces.of(contiguous)
        else:
            data = contiguous.tobytes()
        return {"dtype": dtype.name, "shape": list(arr.shape), "data": data}


PIECE_BYTES = 1 << 20
WIRE_CONTEXT: dict[str, Any] = {"wire": True}  # proto.base.encode's dump, by identity


class Pieces:
    """An array's bytes as copies of ``PIECE_BYTES`` at most, in order, for the wire encoder alone
    (:func:`proto.base.encode`): numpy's ``tobytes`` copies a whole array holding the
    interpreter, and a thread that does so keeps the caller's event loop waiting for as long."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: tuple[bytes, ...]) -> None:
        self.pieces = pieces

    @classmethod
    def of(cls, contiguous: np.ndarray) -> Pieces:
        flat = memoryview(contiguous).cast("B")
        return cls(tuple(flat[i : i + PIECE_BYTES].tobytes() for i in range(0, flat.nbytes, PIECE_BYTES)))


Int32Array = Annotated[np.ndarray, ArraySpec("int32")]
Float32Array = Annotated[np.ndarray, ArraySpec("float32")]
Uint8Array = Annotated[np.ndarray, ArraySpec("uint8")]
# [tokens, layers, top_k] expert indices: uint8 covers up to 256 experts (Qwen3-MoE has 128).
RoutedExpertsArray = Annotated[np.ndarray, ArraySpec("uint8", "int16", "int32", ndim=3)]


def arrays_equal(a: Any, b: Any) -> bool:
    """Equality that treats ndarrays by value (NaN equal to NaN) and recurses into containers."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
        )
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(arrays_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(arrays_equal(a[k], b[k]) for k in a)
    return a == b
