"""The shared-base actor/critic engine, its optimizer and gradient handling."""
