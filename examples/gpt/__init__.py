"""Helpers of examples/pretrain_gpt.py: flags, data, model, checkpointing, terminal output.

``cpu_compat`` holds everything that exists only to run megatron-core on a CPU-only host,
``torch_adam_compat`` megatron-core's distributed optimizer over torch's Adam (no
Transformer Engine or Apex, CPU or GPU), ``devices`` which GPU a rank takes.
"""

import warnings

# megatron-core warns, once per module and rank, that Transformer Engine and Apex are
# absent (this example does not need them), that its own default CUDA-graph scope is
# deprecated, and its torch_dist loader calls PyTorch APIs that PyTorch deprecates.
# None of it is actionable for a user of this example.
for _message in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "`load_state_dict` is deprecated",
    "Please use DTensor instead and we are deprecating ShardedTensor",
):
    warnings.filterwarnings("ignore", message=_message)
