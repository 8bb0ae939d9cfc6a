"""kinfer's built-in plugins: backends (llama.cpp, MLX), draft policies and placements. Each is an
ordinary plugin that uses only the plugin contract (kinfer_rpc.types, kinfer_rpc.hookspecs), loaded
by name from kinfer_rpc.host.plugins.DEFAULT_PLUGINS as a third-party one is from its entry point."""
