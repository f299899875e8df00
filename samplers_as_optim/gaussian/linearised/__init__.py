"""The linearised network: output Jacobians, the function-space Gaussian, the GLM predictive."""
