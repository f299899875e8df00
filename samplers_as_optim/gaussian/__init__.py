"""Gaussian approximations (Laplace, KFAC, EKF, SWAG, VI) and their curvature."""
