"""Compare like with like: "the same head" means the same weights on the same kernels.

A head a test builds runs its linears through `nn.Linear` (MKL's sgemm); the same head loaded by
`heads.checkpoint.load_head` (or imported) runs them as its target's do (`target.kernels`, target/kernels.py: oneDNN
with packed weights for an fp32 target on a CPU). The two are different GEMMs and may round differently in the last
bit: on an Intel Xeon with AMX they do (4.2997 vs 4.2998), on an AMD EPYC they happened not to. A test asking "did
the round trip keep the head" compares the weights bit for bit and the outputs on one kernel path: `as_loaded` puts
the built head on the loaded head's. (Exactness of decoding is a different claim, tested on tokens: decode/argmax.py.)
"""

from selfspec.target.kernels import use as use_kernels


def as_loaded(head, target):
    """`head` with its linears routed as a head loaded for `target` routes them (idempotent); returns it."""
    use_kernels(head, target.kernels)
    return head
