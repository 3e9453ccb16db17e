"""FLA's gate and beta activations where the kernels load g / beta (gdn_prepare, gdn_fwd_fused, gdn_bwd_chunk).

gate_mode, a run-time int (bits below; flash_qla/gates.py holds the same values and the torch specification):
  GATE          g is the raw gate: the log-decay is g_log = -exp(A_log[h]) * softplus(g + dt_bias[h]) (softplus
                threshold 20, as torch's and FLA's),
  GATE_BIAS     dt_bias is given (else its pointer is unread),
  BETA_SIGMOID  beta holds logits: sigmoid(beta),
  NEG_EIGVAL    with BETA_SIGMOID: 2 * sigmoid(beta) (beta in (0, 2)).
One build serves every mode: the branch is uniform over the CTA, so a plain call runs the code it ran before and a
fused call adds a few exp / log1p per token, beside loads it already made. A compile-time axis would double the
variant matrix of all three kernels for no measurable gain.
Rows past a sequence end stay 0 (g_log = 0, beta = 0): callers apply these only to valid rows.
"""
import tilelang.language as T

GATE = 1
GATE_BIAS = 2
BETA_SIGMOID = 4
NEG_EIGVAL = 8
SOFTPLUS_THRESHOLD = 20.0


def gate_arg(g, a_log, dt_bias, mode):
    """g + dt_bias (dt_bias only where given): softplus's argument."""
    return g + T.if_then_else((mode & GATE_BIAS) != 0, dt_bias, T.float32(0))


def softplus(x):
    """log(1 + exp(x)), x itself above the threshold (as torch.nn.functional.softplus)."""
    return T.if_then_else(x > SOFTPLUS_THRESHOLD, x, T.log1p(T.exp(T.min(x, SOFTPLUS_THRESHOLD))))


def sigmoid(x):
    return T.float32(1) / (T.float32(1) + T.exp(-x))


def gate_log(g, a_log, dt_bias, mode):
    """g_log = -exp(A_log) * softplus(g + dt_bias) from the raw gate g."""
    return -T.exp(a_log) * softplus(gate_arg(g, a_log, dt_bias, mode))


def gate_slope(g, a_log, dt_bias, mode):
    """d g_log / d g = -exp(A_log) * sigmoid(g + dt_bias) (1 in place of the sigmoid above the threshold, as
    torch's softplus backward)."""
    x = gate_arg(g, a_log, dt_bias, mode)
    return -T.exp(a_log) * T.if_then_else(x > SOFTPLUS_THRESHOLD, T.float32(1), sigmoid(x))


def beta_scale(mode):
    return T.if_then_else((mode & NEG_EIGVAL) != 0, T.float32(2), T.float32(1))


def beta_act(b, mode):
    """sigmoid(b), times 2 with NEG_EIGVAL."""
    return sigmoid(b) * beta_scale(mode)


def beta_slope(beta, mode):
    """d beta / d b from the activated beta = m s (m = 1 or 2): m s (1 - s) = beta (1 - beta / m), the form of
    torch's sigmoid backward (from its output)."""
    return beta * (T.float32(1) - beta / beta_scale(mode))
