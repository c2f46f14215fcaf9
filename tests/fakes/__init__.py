"""Stand-ins for runners this machine cannot install (vllm-neuron's Beta runner), driving the plugin as they do."""
