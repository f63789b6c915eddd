from beamc.spec.load import load_spec, parse_spec
from beamc.spec.schema import ModelSpec, SpecError

__all__ = ["ModelSpec", "SpecError", "load_spec", "parse_spec"]
