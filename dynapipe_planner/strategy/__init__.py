"""Hydraulis (seed hydraulis.txt): heterogeneous parallel strategies for long-tailed data.

`schemes` profiles each pipeline layout (MaxLen, UtilLen, T(l)); `proposal` proposes the
candidate strategies from the dataset's length distribution; `dispatch` sends an iteration's
sequences to a strategy's pipelines and `packing` packs them within one; `selection` picks and
plans each iteration's strategy; `candidates` fixes the strategies a training job builds process
groups for before its first iteration.
"""
