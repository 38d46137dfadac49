"""Q-Filters: the scorer (`method`) and its filters, fitted on calibration queries (`filters`)."""
