"""The run configuration: schema (`schema.py`), the Axolotl and Accelerate dialects (`dialects.py`), loading with
env and CLI overrides (`load.py`). Everything downstream reads a validated, frozen `RunConfig`."""
from adapter.config.dialects import set_dotted
from adapter.config.load import build, load, parse_sets, read_yaml, resolve_model_path, with_grad_accum
from adapter.config.schema import RunConfig

__all__ = ["RunConfig", "build", "load", "parse_sets", "read_yaml", "resolve_model_path", "set_dotted",
           "with_grad_accum"]
