"""Full-batch Hamiltonian Monte Carlo: integrator, Metropolis test, adaptation, Optimizer."""
