"""The host layer: what a server holds. The model store (names, Ollama's store, the embedded
default), loading and placement, chat templates, the plugins; each loaded model runs on an engine."""
