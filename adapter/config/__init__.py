"""The run configuration: the schema (`schema.py`) and the rules every value obeys (`values.py`), the Axolotl
dialect (`axolotl.py`: its booleans and numbers read in `axolotl_values.py`, its mappings by concern in
`axolotl_train.py`, `axolotl_parallel.py` and `axolotl_data.py`, refusals in `axolotl_scope.py`) and Accelerate's
(`accelerate.py`), hub ids (`hub.py`), loading with env and CLI overrides (`load.py`). Everything downstream reads
a validated, frozen `RunConfig`."""
from adapter.config.load import (
    build,
    compile_note,
    load,
    model_path_of,
    parse_sets,
    read_yaml,
    resolve_model_path,
    setting,
    spell,
    with_grad_accum,
)
from adapter.config.schema import RunConfig, set_dotted

__all__ = ["RunConfig", "build", "compile_note", "load", "model_path_of", "parse_sets", "read_yaml",
           "resolve_model_path", "set_dotted", "setting", "spell", "with_grad_accum"]
