"""Model builders (graph + parameter names matching their PyTorch references)."""
