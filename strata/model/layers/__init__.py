"""The shared layers every architecture stacks (strata/model/archs/), each a load and a run
written only against the Backend, so that both backends execute the same code: attention (plain
or gated), ffn (dense SwiGLU), moe (routed experts, optionally a shared expert), delta_net (Gated
DeltaNet), block (norm, mixer, norm, FFN), rope; hparams and tensors say what they read."""
