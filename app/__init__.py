"""Entry points and wiring: config, the Serve app builder, CLIs, the embedded default model."""
