"""Micro-batch construction: DynaPipe's DP and the baselines it is compared with."""
