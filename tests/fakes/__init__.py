"""Stand-ins for what this machine cannot install (vLLM Neuron's runner, torch-neuronx's NKI interface), driving the
plugin as they do."""
