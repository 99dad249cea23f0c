"""Ray actors that hold resources (engines, trainers, placement groups) and ask planners/ for decisions."""
