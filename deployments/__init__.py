"""Ray Serve deployments: HTTP in, planner and replica calls out."""
