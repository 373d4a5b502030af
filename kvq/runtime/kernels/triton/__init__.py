"""Triton kernels, one file per kernel family, each the launcher of a torch reference kept next to its
contract (`kvq.runtime.kernels.paged`, `w4a16`, `fused_moe`, `integrity`). The only modules of kvq that
import Triton; nothing imports them until a call on the triton backend runs."""
