"""What `strata mtp train` is asked to do: one TrainConfig that the data, fit and pipeline stages read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    pack: str | None
    out: str
    steps: int = 300
    data: list[str] = field(default_factory=list)
    device: str = "cpu"  # cpu or cuda: where the draft trains, and the backend the target collects data on
    prompts: int = 200
    answers: int = 1  # answers the target writes per prompt (the extra ones sampled)
    self_prompts: int = 0  # requests the target writes itself (self_prompts.py), answered greedily
    draft_vocab: int = 0  # > 0: store the tokens the target wrote most as the draft's vocabulary (vocab.py)
    train_budget_s: float | None = None  # train about this long: the step count is fitted (fit.StepPlan)
    max_new: int = 160
    slots: int | None = None  # sequences generated together per window (None: 64 on cuda, 16 on the CPU)
    batch_tokens: int = 2048
    lr: float = 1e-3
    two_pass: bool = True
    passes: int = 2  # draft positions trained by unrolling (1: position 1 only; two_pass=False forces 1)
    init: str | None = None  # start from this draft GGUF's weights instead of the target's last layer
    data_budget_s: float | None = None
    eval_every: int = 50
    measure: bool = True  # acceptance with the real engine at the end
    held_out_per_kind: int | None = None  # held-out prompts per kind (None: all of them)
    note: str | None = None  # appended to the draft's strata-mtp.training metadata
    data_cache: str | None = None  # .npz prefix: reuse collected data if present, else save it there
    seed: int = 0
    engine: str = "auto"  # torch (autograd), xp (xp_net.py: numpy / CuPy, no PyTorch) or auto (torch if installed)

    @property
    def generate_slots(self) -> int:
        """Sequences the target writes together per window."""
        return self.slots if self.slots else (64 if self.device == "cuda" else 16)
