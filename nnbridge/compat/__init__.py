"""Version- and library-specific shims: the only place private torch/nnsight attributes are used."""

from .export import (
    compile_guards as compile_guards,
    constant_outputs as constant_outputs,
    copy_spec as copy_spec,
    empty_module_calls as empty_module_calls,
    export_guards as export_guards,
    export as export,
    forget_export_state as forget_export_state,
    guard_view as guard_view,
    forward_from_source as forward_from_source,
    invocation_graphs as invocation_graphs,
    register_cache_pytrees as register_cache_pytrees,
    rename_nodes as rename_nodes,
    unflatten as unflatten,
)
from .fx import NoSubmoduleRecompile as NoSubmoduleRecompile
from .fx import generated_code_released as generated_code_released
from .fx import generated_line_map as generated_line_map
from .fx import keep_tracebacks as keep_tracebacks
from .hooks import cleared_module_state as cleared_module_state
from .hooks import capturing_hooks as capturing_hooks
from .hooks import has_module_hooks as has_module_hooks
from .hooks import has_user_hooks as has_user_hooks
from .forwards import DirectCall as DirectCall
from .forwards import SwappedBody as SwappedBody
from .forwards import call_overridden as call_overridden
from .forwards import instance_forward as instance_forward
from .forwards import restore_body as restore_body
from .forwards import swap_body as swap_body
from .accelerate import offloaded_weights_loaded as offloaded_weights_loaded
from .output_capturing import MODEL_STATE_ATTRIBUTES as MODEL_STATE_ATTRIBUTES
