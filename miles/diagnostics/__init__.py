"""miles.diagnostics: plots and checks of a run's metrics."""
