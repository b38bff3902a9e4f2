"""Kernels this team writes: one directory per op, each with a plain-torch reference test."""
