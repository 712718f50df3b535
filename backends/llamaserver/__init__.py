"""llama-server as a backend: built here from the vendored llama.cpp, started and stopped by specchat."""
