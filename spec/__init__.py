"""Normative spec of opmx.dynamic_batching::KeyValueCache: the ONNX schema (registered on import)
and model helpers. The prose lives next to this file in KeyValueCache.md."""

from .model import IR_VERSION, make_model, make_node
from .schema import ATTRIBUTE_DEFAULTS, DOMAIN, INPUTS, OP_TYPE, OUTPUTS, VERSION, register

SCHEMA = register()

__all__ = ["ATTRIBUTE_DEFAULTS", "DOMAIN", "INPUTS", "IR_VERSION", "OP_TYPE", "OUTPUTS", "SCHEMA", "VERSION",
           "make_model", "make_node", "register"]
