"""The constructor of megatron's TE linear wrappers (TEColumnParallelLinear / TERowParallelLinear), shared by the
CPU stand-ins of tests/test_fp8_te.py and tests/test_te_decisions.py: the same arguments, the local weight shard of
a column (output split) or row (input split) layer, and the attributes megatron's wrappers set. Each test module
subclasses it with the forward it checks; ``mode`` is set by the ``Col``/``Row`` subclasses."""

from __future__ import annotations

import torch


class TELinearShape(torch.nn.Module):
    mode = ""

    def __init__(self, input_size, output_size, *, config, init_method, bias, skip_bias_add, is_expert=False,
                 tp_comm_buffer_name=None, tp_group=None, gather_output=False, input_is_parallel=True, stride=1,
                 skip_weight_param_allocation=False):
        super().__init__()
        tp = tp_group.size() if tp_group is not None else 1
        self.config, self._tp_group, self.skip_bias_add = config, tp_group, skip_bias_add
        self.parallel_mode, self.sequence_parallel = self.mode, config.sequence_parallel
        out, inp = (output_size // tp, input_size) if self.mode == "column" else (output_size, input_size // tp)
        self.weight = torch.nn.Parameter(torch.empty(out, inp, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out, dtype=config.params_dtype)) if bias else None
