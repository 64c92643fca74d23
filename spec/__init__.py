"""Normative spec of opmx.dynamic_batching::KeyValueCache: the ONNX schema (registered on import)
and model helpers. The prose lives next to this file in KeyValueCache.md."""

from .model import IR_VERSION, make_model, make_node
from .rotary_schema import make_rotary_shift_model
from .rotary_schema import register as register_rotary_shift
from .schema import ATTRIBUTE_DEFAULTS, DOMAIN, INPUTS, OP_TYPE, OUTPUTS, VERSION, register

SCHEMA = register()
ROTARY_SHIFT_SCHEMA = register_rotary_shift()

__all__ = ["ATTRIBUTE_DEFAULTS", "DOMAIN", "INPUTS", "IR_VERSION", "OP_TYPE", "OUTPUTS", "SCHEMA", "VERSION",
           "ROTARY_SHIFT_SCHEMA", "make_model", "make_node", "make_rotary_shift_model", "register", "register_rotary_shift"]
