"""The accuracy rule (flash-attention's): with ref computed in float64 from the same low-precision inputs and
out_lowp a plain implementation in the inputs' own dtype,

    max|out - ref| <= factor * max|out_lowp - ref| + eps,

factor 2 for outputs (3 for gradients), eps one rounding step of the output dtype at max|ref| -- for float32, whose
output rounding is below its arithmetic's, the typical rounding of a D-term dot product, u * sqrt(D) * max|ref|.
NaN never passes.
"""
import math

ROUNDING = {"fp32": 2.0 ** -23, "fp16": 2.0 ** -10, "bf16": 2.0 ** -7}  # unit roundoff 2^-p of each output dtype
DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def dtype_name(dtype):
    """'fp32' / 'fp16' / 'bf16' from a torch or NumPy dtype or one of those names."""
    text = str(dtype).rsplit(".", 1)[-1]
    return DTYPE_NAMES.get(text, text)


def eps(dtype, ref_max, head_dim):
    e = ROUNDING[dtype_name(dtype)] * max(1.0, ref_max)
    return e * math.sqrt(head_dim) if dtype_name(dtype) == "fp32" else e


def bound(err_lowp, dtype, ref_max, head_dim, factor=2.0):
    """The largest error the rule allows."""
    return factor * err_lowp + eps(dtype, ref_max, head_dim)


def verdict(err, err_lowp, dtype, ref_max, head_dim, factor=2.0, what="out"):
    """None if err passes the rule, else the message saying by how much it fails."""
    limit = bound(err_lowp, dtype, ref_max, head_dim, factor)
    if err == err and err <= limit:  # err != err: NaN
        return None
    return (f"max|{what} - ref| = {err:.3g} > {factor:g} * max|{what}_lowp - ref| ({err_lowp:.3g}) + "
            f"{eps(dtype, ref_max, head_dim):.3g}")
