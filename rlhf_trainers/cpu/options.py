""":class:`CPUOptions`: the CPU-only speed switches, an argument group of their own beside the trainers'
configs (as TRL's ``ModelConfig`` sits beside ``GRPOConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["CPUOptions", "resolve_cpu_options"]


@dataclass
class CPUOptions:
    """Speed switches that act only where the trainers run on a CPU (docs/cpu.md lists each one's measured
    effect). The defaults are the automatic choices; a GPU run needs none of them.

    Pass it to a trainer as ``cpu_options=CPUOptions(...)`` (None: these defaults); on the command line
    each field is a flag of its own group (``--mkl_prepacked_decoding true``). The decoding switches act
    on the on-policy trainers' sampling (``generation_loop='builtin'``, the default); ``reuse_host_memory``
    on every trainer's ``train()``.
    """

    _argument_group_name = "CPU speed switches (docs/cpu.md)"

    lean_decoding: bool = field(
        default=True,
        metadata={
            "help": "Run the decoding steps of a transformers LlamaForCausalLM (also under a PEFT adapter) "
            "through its own modules with a preallocated KV cache instead of its forward: the same "
            "arithmetic without the per-step overhead. Other architectures, hooks, device maps and "
            "DeepSpeed-partitioned weights keep the forward. False: the forward at every step."
        },
    )
    mkl_prepacked_decoding: bool | None = field(
        default=None,
        metadata={
            "help": "With lean_decoding: pack the policy's float32 linear weights for MKL's GEMM once per "
            "sampling call instead of MKL re-packing them at every step; identical results, more memory "
            "while sampling. None: on where the CPU's vendor is GenuineIntel. Needs float32 weights, no "
            "bf16/fp16, no DeepSpeed, onednn_linear off. On the command line: true|false."
        },
    )
    merged_adapter_decoding: bool = field(
        default=True,
        metadata={
            "help": "With lean_decoding and a PEFT LoRA policy: merge each LoRA layer's adapters into a copy "
            "of its weight for the decoding steps (one product per layer instead of three; the model "
            "stays unmerged). Float32 results equal the adapter's up to rounding; costs a copy of the "
            "adapted weights while sampling. False: the adapter's forward at every step."
        },
    )
    onednn_linear: bool = field(
        default=False,
        metadata={
            "help": "Opt-in: run the linear layers of the decoding steps (one position per row, float32, no "
            "autocast, no DeepSpeed) through oneDNN instead of PyTorch's default BLAS. Faster on some "
            "CPUs, slower on others: measure first (docs/cpu.md). Training and scoring passes keep "
            "PyTorch's default."
        },
    )
    onednn_linear_min_weights: int = field(
        default=65536,
        metadata={
            "help": "onednn_linear applies when the policy's largest linear layer has at least this many "
            "weights (out x in features); tiny models are bound by per-operation overhead. 0: any size."
        },
    )
    inverse_cdf_sampling: bool = field(
        default=True,
        metadata={
            "help": "Draw each step's tokens by inverting each row's cumulative distribution (one uniform "
            "variate per row) instead of torch.multinomial, which on CPU draws one variate per vocabulary "
            "entry. The same distribution, other draws for a seed than generate(do_sample=True). CPU "
            "only. False: torch.multinomial."
        },
    )
    drop_finished_rows: bool = field(
        default=True,
        metadata={
            "help": "The builtin sampling loop's decoding steps go on without the rows that stopped, once a "
            "quarter or more have (on every device, not only CPU). The draws stay those of the full "
            "batch up to float rounding. False: every row runs to the end, as generate does."
        },
    )
    reuse_host_memory: bool = field(
        default=False,
        metadata={
            "help": "Opt-in, Linux with glibc: keep freed host memory inside the process for the next "
            "allocation (mallopt: no mmap for large blocks, no heap trimming) instead of page-faulting it "
            "in again. Process-wide and permanent: resident memory stays near its high-water mark. "
            "Applied by train() on CPU only."
        },
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "onednn_linear_min_weights":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(
                        f"onednn_linear_min_weights={value!r}: expected an integer >= 0 (0: oneDNN for "
                        "every size)."
                    )
            elif f.name == "mkl_prepacked_decoding":
                if value is not None and not isinstance(value, bool):
                    raise ValueError(f"mkl_prepacked_decoding={value!r}: expected True, False or None.")
            elif not isinstance(value, bool):
                # From Python, a string such as "false" would otherwise count as on.
                raise ValueError(f"{f.name}={value!r}: expected True or False.")


def resolve_cpu_options(options: CPUOptions | None) -> CPUOptions:
    """``options``, or the defaults for None (what the trainers' ``cpu_options=`` takes).

    Raises:
        TypeError: for anything else (e.g. a dict of switches).
    """
    if options is None:
        return CPUOptions()
    if not isinstance(options, CPUOptions):
        raise TypeError(
            f"cpu_options must be an rlhf_trainers.CPUOptions (or None for its defaults); got "
            f"{type(options).__name__}."
        )
    return options
