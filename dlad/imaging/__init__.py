"""Image pre- and post-processing: numpy reference implementations (the test oracle and the
CPU path). GPU kernels with the same contracts slot in beside them."""
