"""From predictions to conclusions: paired statistics, leaderboards, plots, what a method kept."""
