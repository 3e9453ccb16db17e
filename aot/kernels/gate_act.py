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
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def gate_arg(g, dt_bias, mode):
    """g + dt_bias (dt_bias only where given): softplus's argument."""
    return g + T.if_then_else((mode & GATE_BIAS) != 0, dt_bias, T.float32(0))


def exp_neg_abs(x):
    """exp(-|x|) in (0, 1]: softplus and sigmoid both come from it (one exp2, no overflow)."""
    return T.exp2(-T.abs(x) * LOG2E)


def softplus(x, y):
    """log(1 + exp(x)) = max(x, 0) + log(1 + exp(-|x|)) (y = exp_neg_abs(x)), x itself above the threshold as
    torch.nn.functional.softplus. The hardware log2 of 1 + y: its absolute error (~1e-7) is below g's float32
    rounding next to any decay that matters (log1p's extra digits only refine terms under 1e-7)."""
    return T.if_then_else(x > SOFTPLUS_THRESHOLD, x, T.max(x, T.float32(0)) + T.log2(T.float32(1) + y) * LN2)


def sigmoid(x, y):
    """1 / (1 + exp(-x)) from y = exp_neg_abs(x): exp(-|x|) / (1 + exp(-|x|)) below 0, so small values keep their
    digits."""
    return T.if_then_else(x >= 0, T.float32(1), y) / (T.float32(1) + y)


def gate_log(g, a_log, dt_bias, mode):
    """g_log = -exp(A_log) * softplus(g + dt_bias) from the raw gate g."""
    x = gate_arg(g, dt_bias, mode)
    return -T.exp2(a_log * LOG2E) * softplus(x, exp_neg_abs(x))


def neg_rate(a_log):
    """-exp(A_log): g_log's factor (once per head)."""
    return -T.exp2(a_log * LOG2E)


def head_bias(dt_bias, mode):
    """dt_bias, or 0 without GATE_BIAS (the load reads a valid stand-in address either way)."""
    return T.if_then_else((mode & GATE_BIAS) != 0, dt_bias, T.float32(0))


def gate_decay(g, rate, bias):
    """gate_log with the head's factors made once: rate = neg_rate(A_log), bias = head_bias(dt_bias)."""
    x = g + bias
    return rate * softplus(x, exp_neg_abs(x))


def softplus_slope(x, y):
    """d softplus / dx: sigmoid(x), 1 above the threshold (torch's softplus backward)."""
    return T.if_then_else(x > SOFTPLUS_THRESHOLD, T.float32(1), sigmoid(x, y))


def beta_scale(mode):
    return T.if_then_else((mode & NEG_EIGVAL) != 0, T.float32(2), T.float32(1))


def beta_act(b, mode):
    """sigmoid(b), times 2 with NEG_EIGVAL."""
    return sigmoid(b, exp_neg_abs(b)) * beta_scale(mode)


def beta_slope(beta, mode):
    """d beta / d b from the activated beta = m s (m = 1 or 2): m s (1 - s) = beta (1 - beta / m), the form of
    torch's sigmoid backward (from its output)."""
    return beta * (T.float32(1) - beta / beta_scale(mode))
