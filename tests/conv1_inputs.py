"""Random inputs of conv1's backward kernels (first_conv, conv1_gram), shared by
their test modules (a helper module, not a test module: test modules never
import each other)."""

from common.checking import random_array

import numpy as np


def bn_backward_inputs(rng, n, ci, h, w, c_out, first_window_open=False):
    """Fresh random host inputs (float32; argmax int8) of conv1's backward: the
    images, conv1's weight and bias, the pooled gradient, the forward's records
    (argmax, the winners' z) and batchnorm's statistics and gradients, drawn at
    random rather than from the batch, so no sum cancels to 0.
    ``first_window_open``: each channel's first window has its ReLU open (so a
    sum over the open windows is never empty)."""
    ph, pw = h // 2, w // 2
    a = {
        "x": random_array((n, ci, h, w), np.float32, rng),
        "w": random_array((c_out, ci, 3, 3), np.float32, rng),
        "b": random_array(c_out, np.float32, rng),
        "dpooled": random_array((n, c_out, ph, pw), np.float32, rng),
        "argmax": rng.integers(0, 4, (n, c_out, ph, pw)).astype(np.int8),
        "zwin": random_array((n, c_out, ph, pw), np.float32, rng),
        "mean": random_array(c_out, np.float32, rng),
        "invstd": random_array(c_out, np.float32, rng, 0.5, 2.0),
        "gamma": random_array(c_out, np.float32, rng),
        "scale": random_array(c_out, np.float32, rng),
        "shift": random_array(c_out, np.float32, rng),
        "dgamma": random_array(c_out, np.float32, rng),
        "dbeta": random_array(c_out, np.float32, rng),
    }
    if first_window_open:
        a["zwin"][0, :, 0, 0] = (1 - a["shift"]) / a["scale"]
    return a
