"""The call spec of a grouped GEMM: every argument of one call other than its tensors, as one frozen value.

A public function builds the spec once (:meth:`CallSpec.of`: one dict look-up for arguments seen before);
the launcher, its plan cache (the spec's ``key`` is part of the plan's) and the custom op it traces as take
it as it is. The custom op's schema is generated from the spec's fields, so the argument list is written
once, here: :func:`op_schema` for the schema, :meth:`CallSpec.op_args` and :meth:`CallSpec.from_op` for the
values on either side of the op."""

from __future__ import annotations

import dataclasses

import torch

from ..epilogue import Epilogue
from .config import GroupedConfig, config_arg, config_list, config_of

# The schema type of each field's annotation, and how a value crosses the op (a config as its int list).
_OP_TYPES = {"str": "str", "bool": "bool", "int": "int", "GroupedConfig | None": "int[]?"}
_TO_OP = {"GroupedConfig | None": config_list}
_FROM_OP = {"GroupedConfig | None": config_of}
# The argument types a spec is kept for (see CallSpec.of): none that compares equal to another's value
# (an Epilogue is the int it stands for), so that a kept spec is the one these arguments parse to.
_KEPT_TYPES = (str, bool, type(None), GroupedConfig)


def epilogue_name(epilogue) -> str:
    """A public ``epilogue`` argument as a spec holds it: its name (an unknown string is refused where the
    call is checked; a value of another type here, naming ``epilogue``)."""
    return epilogue if type(epilogue) is str else Epilogue.parse(epilogue).name.lower()


# How a public argument becomes a spec's field, by field name (the rest are taken as given).
_PARSE = {"epilogue": epilogue_name, "config": config_arg}


class CallSpec:
    """What the spec dataclasses below share: their making from public arguments, their plan-cache key
    (``key``: the fields' values as a plain tuple, hashed in C), and the custom-op side (fields: str, bool
    or GroupedConfig | None)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", tuple(getattr(self, name) for name, _ in _FIELDS[type(self)]))

    @classmethod
    def parse(cls, *args) -> CallSpec:
        """The spec of a public call's arguments, in field order (an epilogue's name or the Epilogue, a
        config or its dict); a bad ``config`` or epilogue type raises, naming it."""
        return cls(*(_PARSE[name](v) if name in _PARSE else v for (name, _), v in zip(_FIELDS[cls], args)))

    @classmethod
    def of(cls, *args) -> CallSpec:
        """:meth:`parse`, kept per distinct arguments, so that a repeat call looks its spec up (not while
        torch.compile traces: the trace would guard on the kept specs)."""
        if torch.compiler.is_compiling():
            return cls.parse(*args)
        kept = _KEPT[cls]
        try:
            spec = kept.get(args)
        except TypeError:  # an unhashable argument (a config's dict)
            return cls.parse(*args)
        if spec is None:
            spec = cls.parse(*args)
            if all(type(v) in _KEPT_TYPES for v in args):
                kept[args] = spec
        return spec

    def op_args(self) -> tuple:
        """The spec's values as its custom op takes them, in field order."""
        return tuple(
            _TO_OP[t](getattr(self, name)) if t in _TO_OP else getattr(self, name)
            for name, t in _FIELDS[type(self)]
        )

    @classmethod
    def from_op(cls, values) -> CallSpec:
        """The inverse of :meth:`op_args`."""
        return cls(*(_FROM_OP[t](v) if t in _FROM_OP else v for (_, t), v in zip(_FIELDS[cls], values)))


def op_schema(cls, tensors: str, returns: str, tail: str = "") -> str:
    """The schema of a custom op taking ``tensors`` (the schema's tensor arguments, written out), then the
    fields of the spec class ``cls``, then ``tail`` (further arguments, written out)."""
    fields = ", ".join(f"{_OP_TYPES[t]} {name}" for name, t in _FIELDS[cls])
    return f"({tensors}, {fields}{', ' + tail if tail else ''}) -> {returns}"


def register_op(
    name: str, cls, tensors: str, impl, mutates_args=("out",), returns: str = "()", tail: str = ""
):
    """The torch custom op ``name`` over ``tensors``, the spec ``cls`` and ``tail``: ``impl(spec, *tensors,
    *tail)`` runs it. Without a return value (it writes into an output it is given), whatever ``impl``
    returns is dropped and the fake implementation writes nothing (the output is the caller's)."""
    n = tensors.count("Tensor")
    end = n + len(_FIELDS[cls])
    returns_none = returns == "()"

    def run(*args):
        result = impl(cls.from_op(args[n:end]), *args[:n], *args[end:])
        return None if returns_none else result

    schema = op_schema(cls, tensors, returns, tail)
    op = torch.library.custom_op(name, run, mutates_args=mutates_args, schema=schema)
    if returns_none:
        op.register_fake(lambda *args: None)
    return op


def split_op_args(cls, tensors: str, args: tuple) -> tuple:
    """(spec, tensors, tail) of the arguments of an op of :func:`register_op` (for its fake implementation
    and autograd)."""
    n = tensors.count("Tensor")
    end = n + len(_FIELDS[cls])
    return cls.from_op(args[n:end]), args[:n], args[end:]


@dataclasses.dataclass(frozen=True)
class GroupedCall(CallSpec):
    """A call of :func:`moegemm.grouped.grouped_mm` (``swiglu``: of ``grouped_mm_swiglu``)."""

    w_layout: str = "nk"
    epilogue: str = "none"
    swiglu: bool = False
    config: GroupedConfig | None = None
    allow_tf32: bool = False
    validate: bool = True


@dataclasses.dataclass(frozen=True)
class MaskedCall(CallSpec):
    """A call of :func:`moegemm.grouped.grouped_mm_masked`."""

    w_layout: str = "nk"
    epilogue: str = "none"
    config: GroupedConfig | None = None
    allow_tf32: bool = False
    check_masked_m: bool = False
    leave_tail_unwritten: bool = False


@dataclasses.dataclass(frozen=True)
class FFNCall(CallSpec):
    """A call of :func:`moegemm.grouped.moe_ffn` (``save_gate_up``: None, the library's default)."""

    w_layout: str = "nk"
    validate: bool = True
    save_gate_up: bool | None = None


@dataclasses.dataclass(frozen=True)
class FFNTrain(CallSpec):
    """A training call of :func:`moegemm.grouped.moe_ffn`, past its routing: ``save`` keeps the gate/up
    product for the backward."""

    w_layout: str = "nk"
    top_k: int = 1
    save: bool = True


# Each spec class's (field, annotation) pairs, read once here: Dynamo does not trace dataclasses.fields.
_FIELDS = {
    cls: tuple((f.name, f.type) for f in dataclasses.fields(cls))
    for cls in (GroupedCall, MaskedCall, FFNCall, FFNTrain)
}
_KEPT: dict = {GroupedCall: {}, MaskedCall: {}, FFNCall: {}}  # CallSpec.of's specs, per class and arguments

# The specs of the library's own grouped GEMM calls inside a layer, per (w_layout, swiglu): their group
# offsets come from the layer's routing, so they are not checked again.
UNCHECKED = {
    (layout, swiglu): GroupedCall(layout, swiglu=swiglu, validate=False)
    for layout in ("nk", "kn")
    for swiglu in (False, True)
}
