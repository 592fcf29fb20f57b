.PHONY: figures figures-quick

# Every paper figure into examples/out/ (see examples/README.md).
figures:
	examples/all.sh

figures-quick:
	QUICK=1 examples/all.sh
