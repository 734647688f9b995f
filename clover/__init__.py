"""Clover: block-diffusion language models."""
