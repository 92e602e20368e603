"""DeepSpeed ZeRO-1/2/3 through accelerate: the trained module and the optimizer become its engine."""

from __future__ import annotations

import contextlib

import torch

from flowrl.plan.declarations import StrategyTerms

from . import register
from ._base import Strategy

#: DeepSpeed's default `reduce_bucket_size` (elements), which configs/accelerate/deepspeed_zero*.yaml leave as it is:
#: ZeRO-1/2 allocate a gradient bucket of this many elements, in the trained weights' dtype, for the reduction
REDUCE_BUCKET = 500_000_000
FULL_LOW_PRECISION = ("full fine-tuning of bf16/fp16 weights under DeepSpeed would keep their optimizer states in that "
                      "dtype: use train.sharding=fsdp (float32 master shards) or model.dtype=float32")


@register
class DeepSpeed(Strategy):
    """`accelerate launch` with a DEEPSPEED config: ZeRO partitions the optimizer state (stage 1), the gradients (2)
    and the weights (3) over the processes. flowrl accumulates a minibatch's passes itself (the last is the
    accumulation boundary) and the engine's step clips to train.max_grad_norm; the precision stays flowrl's
    (model.dtype, float32 trained weights): DeepSpeed's bf16 / fp16 would cast the trained weights too. Checkpoints
    hold the weights and a plain AdamW's state, gathered from the partitions, so that any backend resumes them."""

    name = "deepspeed"
    shards = ("gradients", "optimizer")  # ZeRO-2's; ZeRO-3 shards the weights too (`sharded`)
    # One column, ZeRO-2's: ZeRO-3 is this class with zero_stage 3 in the accelerate config, and its memory is the
    # FSDP column's (weights, gradients and states partitioned, with FSDP's limits) plus its buffers.
    plan_column = "ZeRO-2"
    plan_note = ("ZeRO-2: DeepSpeed ZeRO stage 2 (configs/accelerate/deepspeed_zero2.yaml): gradients and AdamW states "
                 "partitioned, weights whole, plus ZeRO's float32 partition of the trained weights and its gradient "
                 f"bucket ({REDUCE_BUCKET:,} float32, DeepSpeed's default size). ZeRO-3 (deepspeed_zero3.yaml, the "
                 "same strategy at zero_stage 3) partitions the weights too, as the FSDP column does, with ZeRO's "
                 "buffers on top: it has no column of its own")

    @classmethod
    def plan_terms(cls, trained, gpus):
        """ZeRO-1/2's float32 copy of this process's partition of the trained weights (float32 ones too: flowrl
        refuses the others), and the gradient bucket each backward pass allocates and releases."""
        return StrategyTerms(kept=(("ZeRO-2: float32 partition of the weights", 4 * trained / gpus),),
                             backward=(("ZeRO-2: gradient bucket, backward only", 4 * REDUCE_BUCKET),))

    @classmethod
    def config_problem(cls, cfg):
        if cfg.train.optimizer != "adamw":
            return (f"train.optimizer={cfg.train.optimizer} under DeepSpeed: its ZeRO optimizer wraps torch's AdamW; "
                    "use train.optimizer=adamw (ZeRO already partitions the states)")
        if not cfg.lora.enabled and cfg.model.dtype != "float32":
            return FULL_LOW_PRECISION
        return ""

    priority = 30  # an accelerate DEEPSPEED config, even with one process

    @classmethod
    def applies(cls, cfg, num_processes, launch):
        return launch == "DEEPSPEED"

    def __init__(self, cfg, acc):
        super().__init__(cfg, acc)
        self.engine = None

    def prepare(self, policy, make_optimizer):
        self.policy = policy
        self.params = list(policy.trainable_parameters())
        self.opt = make_optimizer(self.params, True)  # after it, DeepSpeed prepares both together
        ds = self.acc.state.deepspeed_plugin.deepspeed_config
        if any(ds.get(k, {}).get("enabled") in (True, "auto") for k in ("bf16", "fp16")):
            raise ValueError("DeepSpeed's bf16 / fp16 would cast flowrl's float32 trained weights: set "
                             "mixed_precision: \"no\" in the accelerate config (model.dtype=bfloat16 keeps the frozen "
                             "weights in bf16)")
        problem = self.config_problem(self.cfg)
        if problem:
            raise ValueError(problem)
        if any(p.dtype != torch.float32 for p in self.params):  # what config_problem foresees from the config
            raise ValueError(FULL_LOW_PRECISION)
        ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                  gradient_clipping=max(self.cfg.train.max_grad_norm, 0.0))
        if ds.get("zero_optimization", {}).get("stage") == 3:  # the weights partitioned, as FSDP's (`sharded`)
            if not hasattr(policy, "shard") or self.cfg.train.ema_decay > 0:
                raise ValueError("DeepSpeed ZeRO-3 trains image models without train.ema_decay (as train.sharding="
                                 "fsdp); use ZeRO-2 (configs/accelerate/deepspeed_zero2.yaml)")
            policy.sharded = True

        def make_engine(module):
            self.engine, _ = self.acc.prepare(module, self.opt)
            return self.engine

        policy.wrap_trained(make_engine)
        return self.opt

    @property
    def equal_passes(self) -> bool:
        return True  # every engine pass takes part in ZeRO's collectives

    def gradient_sync(self, sync):
        self.engine.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def backward_loss(self, loss):
        if not torch.isfinite(loss):
            return loss * float("nan")  # a NaN gradient everywhere: DeepSpeed's step skips it on every process
        return loss

    def clip_gradients(self, max_norm):
        """The norm of ZeRO's partitioned gradient; the engine's step does the clipping."""
        from deepspeed.runtime.utils import combine_grad_norm_groups

        zero = self.engine.optimizer
        norm = (zero.scaled_global_norm() if hasattr(zero, "scaled_global_norm")
                else combine_grad_norm_groups(zero._get_norm_groups()))
        return float(norm)

    def step(self):
        self.engine.step()  # clips to train.max_grad_norm itself

    def skip_step(self):
        self.engine.step()  # DeepSpeed takes no step on a non-finite gradient (see backward_loss): drops it
        self.opt.zero_grad(set_to_none=True)

    def gathered(self, modifier_rank=None):
        if self.engine is None or not self.engine.zero_optimization_partition_weights():
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(self.params, modifier_rank=modifier_rank)

    def optimizer_state(self):
        """A plain AdamW's state_dict (an entry of whole tensors per trained weight), gathered from ZeRO's
        partitions (a collective: every process calls it)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        steps = [st["step"] for st in self.opt.state.values() if "step" in st]
        state = {}
        for i, p in enumerate(self.params):
            moments = {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
            if steps and all(v is not None for v in moments.values()):
                state[i] = {"step": steps[0].clone(), **{k: v.detach().cpu() for k, v in moments.items()}}
        group = {k: v for k, v in self.opt.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_trained(self, named, tensors):
        """The module's weights, then ZeRO's float32 weights from the checkpoint's."""
        super().load_trained(named, tensors)
        from deepspeed.utils import safe_set_full_fp32_param

        for n, p in named.items():
            safe_set_full_fp32_param(p, tensors[n].to(p.device, torch.float32))

    def load_optimizer_state(self, ck):
        """A checkpoint's plain-AdamW state into ZeRO's partitioned state."""
        from deepspeed.utils import safe_set_full_optimizer_state

        states = {int(k): st for k, st in ck.get("optimizer", {}).get("state", {}).items()}
        if not states:
            return
        step = next(iter(states.values()))["step"]
        zero = self.engine.optimizer
        # this process's partition of the float32 weights (ZeRO-3's, ZeRO-1/2's): an AdamW state to fill
        flats = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
        for flat in flats:
            self.opt.state[flat] = {"step": torch.as_tensor(step).clone().float(),
                                    **{k: torch.zeros_like(flat) for k in ("exp_avg", "exp_avg_sq")}}
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2: (re)link the weights' views into it
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()
        for i, p in enumerate(self.params):
            for k in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, states[i][k].to(p.device), k)
