"""Version- and library-specific shims: the only place private torch, transformers, nnsight and
accelerate attributes are used.

One folder per library (:mod:`.torch`, :mod:`.transformers`, :mod:`.nnsight`; :mod:`.accelerate`
and :mod:`.libc` are single modules). Every run-time patch of another library is declared in
:mod:`.registry` with what it replaces, why, the versions it was verified on and whether it
exists for correctness or only for speed. This layer imports nothing of nnbridge but
:mod:`nnbridge.errors`.
"""

from .torch.export import (
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
from .torch.fx import NoSubmoduleRecompile as NoSubmoduleRecompile
from .torch.fx import generated_code_released as generated_code_released
from .torch.fx import generated_line_map as generated_line_map
from .torch.fx import keep_tracebacks as keep_tracebacks
from .torch.hooks import cleared_module_state as cleared_module_state
from .torch.hooks import capturing_hooks as capturing_hooks
from .torch.hooks import has_module_hooks as has_module_hooks
from .torch.hooks import has_user_hooks as has_user_hooks
from .torch.forwards import DirectCall as DirectCall
from .torch.forwards import SwappedBody as SwappedBody
from .torch.forwards import call_overridden as call_overridden
from .torch.forwards import instance_forward as instance_forward
from .torch.forwards import restore_body as restore_body
from .torch.forwards import swap_body as swap_body
from .accelerate import offloaded_weights_loaded as offloaded_weights_loaded
from .transformers.output_capturing import MODEL_STATE_ATTRIBUTES as MODEL_STATE_ATTRIBUTES
