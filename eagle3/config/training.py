"""From answers to a trained drafter: ``[tokenize]``, ``[vocab]``, ``[extract]`` and ``[train]``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from eagle3.config.base import _Strict


class TokenizeConfig(_Strict):
    """Token ids and loss masks (stage ``tokenize``)."""

    tokenizer: str | None = Field(None, description="Tokenizer to use; default: the target model's (server.model).")
    max_seq_len: int = Field(
        4096,
        gt=0,
        description=(
            "Longest training sequence in tokens (prompt + completion). 4096: a long prompt plus a full 2048-token "
            "answer; public recipes train at 2048, and longer costs memory linearly."
        ),
    )
    overflow: Literal["truncate", "drop"] = Field(
        "truncate",
        description=(
            "What to do with longer sequences: truncate keeps the first max_seq_len tokens (the supervised start of "
            "a long answer still teaches); drop removes the row with a reason."
        ),
    )


class VocabConfig(_Strict):
    """The drafter's output vocabulary (stage ``vocab``)."""

    draft_vocab_size: int = Field(
        32000,
        gt=0,
        description=(
            "Size of the draft vocabulary: the most frequent supervised tokens. 32000 is EAGLE-3's choice for "
            "128k-vocab targets; at or above the target vocab the mapping is the identity."
        ),
    )


class ExtractConfig(_Strict):
    """The target's hidden states the drafter trains on (stage ``extract``)."""

    mode: Literal["offline", "online"] = Field(
        "offline",
        description=(
            "offline: run the target once over every tokenized shard and store its states (bf16 safetensors, "
            "tokens x 4 x hidden x 2 bytes); training then reads them and can run for many epochs without the "
            "target. online: store nothing; training runs the same extraction per batch (the target in memory "
            "next to the drafter) -- for datasets whose states would not fit on disk. Default offline: cheapest "
            "for the demo and for more than one epoch."
        ),
    )
    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description=(
            "hf: a transformers forward pass of the target (bf16, device_map across GPUs, CPU works). vllm: "
            "vLLM's own hidden-state extraction in the server.python environment, the route for targets too big "
            "for a transformers forward (offline mode only). Default hf: no second environment needed."
        ),
    )
    layer_ids: list[int] | None = Field(
        None,
        description=(
            "The three auxiliary layers in vLLM numbering (id i = the output of decoder layer i-1, before any "
            "final norm; 1 <= i <= num_hidden_layers). Written into the export, so vLLM feeds the drafter the "
            "same layers when serving. Default: vLLM's own choice (2, L/2, L-3) where those are distinct, else "
            "(1, L/2, L-1), so a small target still gives three different layers."
        ),
    )
    batch_tokens: int = Field(
        16384,
        gt=0,
        description=(
            "Padded tokens per forward pass (samples are bucketed by length, so padding stays small). 16k fits an 8B "
            "target on one 80 GB GPU with room to spare."
        ),
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description=(
            "Dtype the target runs in (states are stored as bf16 either way). bf16 is what vLLM serves in; float32 "
            "only for small targets and tests."
        ),
    )
    storage_dtype: Literal["bfloat16", "fp8_e4m3"] = Field(
        "bfloat16",
        description=(
            "How offline mode stores the states. bfloat16: tokens x 4 x hidden x 2 bytes, exactly what the target "
            "computed in bf16. fp8_e4m3: half that (plus 16 bytes of scales per token), one float32 scale per "
            "token and layer, read back as bf16 within e4m3's rounding (2^-4 relative); for datasets whose bf16 "
            "states would not fit the disk or the file system's bandwidth (docs/scale-out.md). Default bfloat16: "
            "lossless, and the drafter's acceptance with fp8 is measured in benchmarks/README.md before it is "
            "trusted."
        ),
    )
    replicas: int = Field(
        1,
        ge=1,
        description=(
            "Copies of the target, one per GPU (replica r on cuda:r), each extracting its own shards in parallel: "
            "use the GPU count when one GPU holds the target. 1 with several GPUs: one copy spread over all of "
            "them (device_map=auto). CPU: keep 1 (one copy already uses every core)."
        ),
    )
    vllm_chunk_tokens: int = Field(
        65536,
        gt=0,
        description=(
            "vllm backend: tokens per chunk. One worker per shard starts vLLM once (10-60 s on CPU, minutes for a "
            "large GPU target) and extracts the chunks in turn, handing each over as it finishes; a chunk's states "
            "are held in memory (tokens x 4 x hidden x 4 bytes: 4 GiB at 64k tokens for hidden 4096), about two "
            "chunks at a time (one stored while the next is computed), so this bounds memory and disk."
        ),
    )
    timeout_s: float = Field(
        7200.0,
        gt=0,
        description=(
            "Deadline for each chunk of the vllm backend's worker (the first includes starting vLLM): past it the "
            "worker is killed and the shard fails, to be retried."
        ),
    )

    @field_validator("layer_ids")
    @classmethod
    def _three_ids(cls, value):
        if value is not None and (len(value) != 3 or len(set(value)) != 3 or min(value) < 1):
            raise ValueError(f"needs three different layer ids >= 1 (vLLM numbering), got {value}")
        return value


class TrainConfig(_Strict):
    """Drafter training (stage ``train``)."""

    # Sample-efficiency knobs added after runs were on disk: at these values a config hashes as before
    # (section_hash), so an existing run's train marker stays current.
    LATER_KEYS: ClassVar[dict] = {
        "hidden_noise": 0.0,
        "hidden_noise_kind": "gaussian",
        "freeze_lm_head": False,
        "warm_start": "none",
        "warm_start_layer": None,
        "norm_before_fc": False,
        "norm_output": False,
        "optimizer": "adamw",
    }

    ttt_steps: int = Field(
        7,
        ge=1,
        description=(
            "Training-time-test unroll depth K: drafting steps trained per position, each on the drafter's own "
            "previous output (EAGLE-3 uses 7, so drafts of up to 7 tokens are trained for)."
        ),
    )
    step_weight_decay: float = Field(
        0.8,
        gt=0,
        le=1,
        description=(
            "Loss weight of TTT step k is this to the power k (EAGLE-3: 0.8), so early steps, which decide most of "
            "the acceptance, weigh most."
        ),
    )
    learning_rate: float = Field(
        1e-4,
        gt=0,
        description=(
            "Peak AdamW learning rate after warmup (EAGLE-3 recipes use 1e-4 to 5e-5 for 8B+ targets over 50k-500k "
            "samples; small runs need more, see the recipes)."
        ),
    )
    hidden_noise: float = Field(
        0.0,
        ge=0,
        description=(
            "Noise added to the target's tapped hidden states (the fc input) during training, as a multiple of each "
            "token's RMS over those states: the drafter then learns to read states a little off the ones it will see "
            "(EAGLE-1 and speculators add uniform or Gaussian noise for this). Relative, so one value suits any "
            "target's scale. Default 0: off, the public EAGLE-3 recipe; measured per target in "
            "benchmarks/results/sample_efficiency.json."
        ),
    )
    hidden_noise_kind: Literal["gaussian", "uniform"] = Field(
        "gaussian",
        description=(
            "The noise's shape: gaussian (std = hidden_noise x RMS) or uniform (in +-hidden_noise x RMS). Used "
            "only when hidden_noise > 0."
        ),
    )
    freeze_lm_head: bool = Field(
        False,
        description=(
            "Keep the drafter's lm_head at the target's rows of the draft vocabulary (what it starts from) instead "
            "of training it (speculators freezes it; EAGLE-3 trains it). Frozen, the drafter learns a hidden state "
            "the target's own head reads, with fewer parameters to fit from little data. Default False: the EAGLE-3 "
            "recipe."
        ),
    )
    warm_start: Literal["none", "target_layer"] = Field(
        "none",
        description=(
            "How the drafter's decoder layer starts. none: random (every public trainer). target_layer: from the "
            "target's own decoder layer train.warm_start_layer -- the hidden half of q/k/v, o_proj, the MLP and the "
            "norms -- with fc passing the top tapped layer's state straight through and the final norm the "
            "target's, so step 0 starts as the target's layer applied to the state the target itself feeds it. "
            "Default none: the public recipe; measured in benchmarks/results/sample_efficiency.json."
        ),
    )
    warm_start_layer: int | None = Field(
        None,
        ge=0,
        description=(
            "The target decoder layer (0-based) train.warm_start = target_layer copies. Default: the layer the top "
            "tapped state feeds (vLLM aux id i is the input of decoder layer i)."
        ),
    )
    norm_before_fc: bool = Field(
        False,
        description=(
            "EAGLE-3.1: one RMSNorm over the three concatenated tapped states before fc (the drafter's "
            "input_norm), so states of very different scales reach fc alike. vLLM 0.32 serves it (the export "
            "writes norm_before_fc); SGLang's layout cannot hold it. Default False: the EAGLE-3 recipe."
        ),
    )
    norm_output: bool = Field(
        False,
        description=(
            "EAGLE-3.1: each drafting step hands the next one its post-norm state instead of the pre-norm "
            "residual. vLLM 0.32 serves it (the export writes norm_output); SGLang's layout cannot hold it. "
            "Default False: the EAGLE-3 recipe."
        ),
    )
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description=(
            "adamw: every trained tensor takes AdamW (betas 0.9/0.95; every public EAGLE-3 trainer). muon: the "
            "drafter's weight matrices (fc and its decoder layer's projections) take Muon -- momentum 0.95 "
            "(Nesterov), the update orthogonalised by 5 Newton-Schulz steps and scaled by 0.2 x sqrt(max(rows, "
            "cols)) so its RMS matches AdamW's and learning_rate and weight_decay carry over -- while lm_head and "
            "the norms keep AdamW, as Muon's authors advise for output heads and vectors. Muon trains small "
            "language models in fewer steps than AdamW; a drafter short of steps might gain. ddp only (Newton-"
            "Schulz needs each whole matrix; fsdp shards them). Default adamw: the public recipe."
        ),
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="The cosine schedule ends at learning_rate x this.")
    warmup_fraction: float = Field(
        0.05, ge=0, lt=1, description="Share of all optimizer steps spent warming the learning rate up linearly."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (EAGLE-3 trains without).")
    grad_clip: float = Field(0.5, gt=0, description="Gradient-norm clip per optimizer step (EAGLE-3 recipes: 0.5).")
    max_steps: int | None = Field(
        None,
        ge=1,
        description=(
            "Stop after this many optimizer steps (the learning-rate schedule spans them), whatever epochs says. "
            "Default: none, epochs decide. Set it to compare two datasets at the same training compute."
        ),
    )
    epochs: int = Field(
        2,
        ge=1,
        description=(
            "Passes over the training split (public recipes: 2-10 over 50k-500k samples; a second pass still pays)."
        ),
    )
    batch_tokens: int = Field(
        16384,
        gt=0,
        description=(
            "Padded tokens per micro-batch per process (samples bucketed by length). Global batch = batch_tokens x "
            "grad_accum x processes. 16k fits an 8B target's drafter with K=7 on one 80 GB GPU."
        ),
    )
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step per process.")
    loss_chunk_tokens: int = Field(
        1024,
        ge=0,
        description=(
            "Rows per chunk of the fused lm_head + soft cross-entropy and of the target head (train.chunked): the "
            "same loss and gradients without the fp32 [tokens, vocab] logits per TTT step, on counted rows only. "
            "On by default: at SmolLM2's shapes with a 32k draft vocab it halves the loss's peak memory at the same "
            "speed within the noise (benchmarks/bench_train.py). 0: the plain path (full logits per step). 1024 "
            "rows x a 32k draft vocab is 128 MB of fp32 per temporary."
        ),
    )
    compile: bool = Field(
        False,
        description=(
            "torch.compile the drafter's forward (dynamic shapes: micro-batch lengths vary). Off by default: on 2 CPU "
            "cores a cold compile took 140-150 s for 1.14-1.19x faster steps with loss_chunk_tokens = 0 (paid back "
            "after ~400-1,400 steps), and with the chunked loss (the default) the compiled steps were 2.3x slower "
            "(benchmarks/bench_train_compile.py); not measured on a GPU. If you turn it on, set loss_chunk_tokens = 0."
        ),
    )
    eval_fraction: float = Field(
        0.05,
        gt=0,
        lt=1,
        description=(
            "Share of samples held out (by a hash of their id, so the split is stable across reruns) for evaluation."
        ),
    )
    eval_every_steps: int = Field(
        0, ge=0, description="Evaluate on the held-out split every N optimizer steps; 0: at the end of each epoch."
    )
    save_every_steps: int = Field(
        200, ge=1, description="Write a resumable checkpoint every N optimizer steps (and always at the end)."
    )
    seed: int = Field(
        0, description="Seeds initialisation and the data order; a rerun with the same seed repeats the same run."
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description=(
            "ddp: a full drafter copy per process (small drafters: the usual choice). fsdp: shard parameters and "
            "optimizer state across processes."
        ),
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="Autocast dtype on GPU (master weights stay float32). CPU training runs in float32."
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        description=(
            "torchrun --nproc-per-node: processes per node (one per GPU; on CPU, 2 processes already share the cores)."
        ),
    )
    nnodes: int = Field(
        1,
        ge=1,
        description=(
            "torchrun --nnodes: nodes in the job. 1 (default): one machine. With cluster.address set and train in "
            "cluster.stages, one run starts all of them on the Ray cluster (one node per bundle, STRICT_SPREAD); "
            "without a cluster, start torchrun on each node yourself with its train.node_rank."
        ),
    )
    node_rank: int = Field(
        0,
        ge=0,
        description=(
            "torchrun --node-rank of this node (multi-node without a cluster). 0 (default): the first node. Not "
            "used when training runs on the Ray cluster: the cluster gives each node its rank."
        ),
    )
    rdzv_endpoint: str = Field(
        "",
        description=(
            "torchrun rendezvous host:port. Empty (single node): torchrun --standalone picks a free local port, so "
            "two runs on one machine never collide (a fixed port made the second one fail with EADDRINUSE). "
            "Multi-node: required, an address of node 0 every node reaches. Not used when training runs on the Ray "
            "cluster: the cluster sets the rendezvous (node 0's IP and a free port, torchrun's static rendezvous)."
        ),
    )
    rdzv_id: str = Field(
        "eagle3",
        description=(
            "torchrun rendezvous id shared by the nodes of one job (default eagle3: one job per rendezvous "
            "endpoint). Not used on the Ray cluster (static rendezvous)."
        ),
    )
    timeout_s: float = Field(
        172800.0,
        gt=0,
        description=(
            "Deadline for the whole torchrun job (48 h); it is stopped after this and the next run resumes from its "
            "last checkpoint."
        ),
    )

    @model_validator(mode="after")
    def _node_rank_in_range(self):
        # The endpoint a multi-node job needs is checked in PipelineConfig: on the Ray cluster there is none.
        if self.node_rank >= self.nnodes:
            raise ValueError(f"train.node_rank={self.node_rank} must be below train.nnodes={self.nnodes}")
        if self.optimizer == "muon" and self.strategy == "fsdp":
            raise ValueError(
                "train.optimizer='muon' needs whole weight matrices and train.strategy='fsdp' shards them; "
                "use train.strategy='ddp' (a drafter fits every process) or train.optimizer='adamw'"
            )
        return self
