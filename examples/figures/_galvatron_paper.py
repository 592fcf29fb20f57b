# ruff: noqa: E501  (the tables are quoted line by line as the paper prints them)
"""The cells of Galvatron-BMW's Tables II-IV as printed in the paper (seed `galvatron_bmw.txt`,
§VII-B and §VII-D), quoted so that the table scripts can set them beside ours.

Each line is "<cluster> <budget> <the paper's strategy label> <one cell per column>", a cell
being "samples/s (global batch)" or "OOM"; the columns are the table's model headers.
"""

from __future__ import annotations

import re

COLUMNS = {
    "TABLE_II": [
        "BERT-Huge-32",
        "BERT-Huge-48",
        "ViT-Huge-32",
        "ViT-Huge-48",
        "T5-Large-32",
        "T5-Large-48",
        "Swin-Huge-32",
        "Swin-Huge-48",
    ],
    "TABLE_III": [
        "BERT-Huge-32",
        "BERT-Huge-48",
        "ViT-Huge-32",
        "ViT-Huge-48",
        "T5-512/4-32",
        "T5-512/4-48",
    ],
    "TABLE_IV": ["BERT-xHuge", "ViT-xHuge"],
}
# The paper's row labels -> the row names of benchmarks/galvatron_tables.py's ROWS
ROW_NAMES = {
    "PyTorch DDP (DP)": "DP",
    "Megatron (TP)": "TP",
    "PyTorch GPipe (PP)": "PP",
    "FSDP/ZeRO-3 (SDP)": "SDP",
    "DeepSpeed 3D": "3D (TP2 PP2 DP2)",
    "Galvatron (DP+TP)": "DP+TP",
    "Galvatron (DP+PP)": "DP+PP",
    "Galvatron": "Galvatron",
    "Galvatron (1F1B+Bi-obj)": "Galvatron (1F1B+Bi-obj)",
    "Galvatron-Base": "Galvatron-Base",
    "Galvatron-BMW": "Galvatron-BMW",
}
_CELL = re.compile(r"OOM|[\d.]+ \(\d+\)")

TABLE_II = """\
8xTITAN 8G PyTorch DDP (DP) OOM OOM OOM OOM OOM OOM OOM OOM
8xTITAN 8G Megatron (TP) OOM OOM 16.16 (24) 10.65 (16) OOM OOM 13.47 (24) 8.41 (8)
8xTITAN 8G PyTorch GPipe (PP) OOM OOM 20.57 (56) 16.59 (32) OOM OOM 23.61 (40) 16.42 (24)
8xTITAN 8G FSDP/ZeRO-3 (SDP) 4.65 (8) OOM 33.25 (64) 15.71 (40) 5.97 (8) OOM 24.86 (48) 11.92 (32)
8xTITAN 8G DeepSpeed 3D 7.79 (8) OOM 30.56 (40) 14.59 (16) 8.12 (8) OOM 26.22 (32) 14.27 (16)
8xTITAN 8G Galvatron (DP+TP) OOM OOM 29.4 (32) 15.76 (16) OOM OOM 26.18 (24) 14.76 (16)
8xTITAN 8G Galvatron (DP+PP) OOM OOM 31.79 (48) 20.93 (24) 9.37 (8) OOM 27.18 (40) 17.71 (24)
8xTITAN 8G Galvatron 8.16 (8) OOM 36.58 (56) 20.93 (24) 9.37 (8) OOM 31.33 (48) 21.64 (32)
8xTITAN 8G Galvatron-Base 17.04 (88) 9.99 (72) 64.03 (544) 35.89 (512) 11.50 (56) 6.87 (56) 34.55 (328) 25.69 (292)
8xTITAN 8G Galvatron (1F1B+Bi-obj) 10.05 (8) OOM 41.85 (56) 23.10 (40) 9.52 (16) OOM 32.95 (56) 22.25 (48)
8xTITAN 8G Galvatron-BMW 19.06 (184) 10.23 (176) 71.57 (568) 38.75 (544) 20.74 (80) 12.74 (64) 65.34 (360) 34.21 (360)
8xTITAN 12G PyTorch DDP (DP) OOM OOM 14.22 (16) OOM OOM OOM OOM OOM
8xTITAN 12G Megatron (TP) 5.72 (8) OOM 16.71 (48) 10.99 (32) 5.14 (8) OOM 13.68 (40) 9.62 (24)
8xTITAN 12G PyTorch GPipe (PP) 9.22 (8) 6.2 (8) 25.13 (104) 16.62 (64) 9.09 (8) 6.83 (8) 26.07 (72) 19.82 (48)
8xTITAN 12G FSDP/ZeRO-3 (SDP) 8.91 (16) 3.15 (8) 47.41 (112) 24.24 (72) 11.26 (16) 4.11 (8) 37.38 (88) 21.98 (64)
8xTITAN 12G DeepSpeed 3D 7.79 (8) 5.35 (8) 37.88 (80) 22.68 (48) 8.12 (8) 5.76 (8) 34.14 (72) 20.07 (40)
8xTITAN 12G Galvatron (DP+TP) 8.92 (8) 5.35 (8) 42.21 (64) 17.2 (32) 9.53 (8) OOM 37.26 (56) 20.18 (32)
8xTITAN 12G Galvatron (DP+PP) 9.22 (8) 6.2 (8) 50.69 (72) 24.01 (56) 11.95 (16) 6.83 (8) 35.87 (56) 21.69 (48)
8xTITAN 12G Galvatron 11.39 (16) 6.2 (8) 50.69 (72) 26.63 (72) 14.49 (16) 6.83 (8) 41.69 (64) 25.42 (64)
8xTITAN 12G Galvatron-Base 18.66 (72) 12.14 (136) 68.46 (568) 43.78 (536) 20.66 (80) 11.14 (72) 58.56 (360) 30.70 (328)
8xTITAN 12G Galvatron (1F1B+Bi-obj) 15.20 (32) 6.82 (8) 54.92 (104) 31.79 (72) 15.24 (24) 9.06 (8) 57.73 (136) 27.02 (96)
8xTITAN 12G Galvatron-BMW 24.37 (192) 15.97 (192) 79.24 (512) 46.94 (568) 24.07 (96) 15.13 (80) 76.86 (384) 47.78 (376)
8xTITAN 16G PyTorch DDP (DP) 6.39 (8) OOM 44.40 (64) OOM 7.79 (8) OOM 28.61 (40) OOM
8xTITAN 16G Megatron (TP) 6.06 (16) 3.88 (8) 16.81 (72) 11.02 (40) 5.14 (8) OOM 13.83 (56) 9.71 (40)
8xTITAN 16G PyTorch GPipe (PP) 12.96 (16) 6.2 (8) 25.26 (144) 17.24 (96) 9.09 (8) 6.83 (8) 28.23 (104) 20.11 (64)
8xTITAN 16G FSDP/ZeRO-3 (SDP) 12.47 (24) 6.06 (16) 59.93 (160) 32.15 (104) 14.95 (24) 7.16 (16) 49.68 (136) 26.46 (88)
8xTITAN 16G DeepSpeed 3D 8.50 (16) 5.35 (8) 41.67 (128) 25.45 (72) 11.52 (16) 5.76 (8) 37.13 (104) 24.12 (64)
8xTITAN 16G Galvatron (DP+TP) 12.59 (16) 6.19 (8) 46.02 (88) 23.97 (48) 14.52 (16) 6.84 (8) 44.65 (80) 26.51 (48)
8xTITAN 16G Galvatron (DP+PP) 13.00 (16) 6.2 (8) 54.05 (120) 28.01 (56) 14.64 (16) 6.83 (8) 44.15 (96) 25.82 (56)
8xTITAN 16G Galvatron 15.05 (24) 7.46 (16) 63.25 (160) 35.74 (104) 16.50 (24) 8.36 (16) 54.06 (136) 29.21 (72)
8xTITAN 16G Galvatron-Base 21.70 (128) 12.92 (96) 75.98 (744) 45.75 (656) 23.67 (88) 15.69 (80) 68.98 (264) 41.15 (360)
8xTITAN 16G Galvatron (1F1B+Bi-obj) 16.61 (32) 10.03 (32) 88.86 (480) 39.39 (104) 16.72 (24) 9.69 (16) 73.20 (392) 39.34 (136)
8xTITAN 16G Galvatron-BMW 27.90 (224) 17.37 (208) 89.22 (520) 50.34 (480) 26.75 (128) 17.05 (112) 84.52 (428) 52.78 (392)
8xTITAN 20G PyTorch DDP (DP) 11.57 (16) OOM 61.54 (112) 17.02 (32) 14.3 (16) 5.43 (8) 42.82 (80) 11.8 (24)
8xTITAN 20G Megatron (TP) 6.06 (16) 3.88 (8) 16.11 (88) 11.02 (56) 5.47 (16) 3.55 (8) 13.84 (72) 9.79 (48)
8xTITAN 20G PyTorch GPipe (PP) 13.52 (24) 7.05 (16) 28.64 (192) 17.96 (128) 9.53 (16) 8.13 (16) 29.75 (128) 20.73 (88)
8xTITAN 20G FSDP/ZeRO-3 (SDP) 17.06 (40) 7.8 (24) 63.75 (216) 38.29 (136) 17.93 (32) 7.16 (16) 55.22 (176) 32.63 (120)
8xTITAN 20G DeepSpeed 3D 8.50 (16) 5.35 (8) 43.36 (168) 27.82 (104) 13.14 (24) 7.96 (16) 40.60 (136) 26.09 (96)
8xTITAN 20G Galvatron (DP+TP) 14.65 (24) 8.05 (16) 61.54 (112) 28.69 (72) 15.35 (24) 6.84 (8) 54.87 (104) 30.59 (72)
8xTITAN 20G Galvatron (DP+PP) 15.52 (24) 8.11 (16) 61.54 (112) 34.88 (96) 17.27 (24) 10.33 (16) 50.19 (136) 31.62 (80)
8xTITAN 20G Galvatron 18.21 (40) 8.95 (24) 70.5 (152) 41.2 (136) 18.64 (32) 10.33 (16) 60.06 (144) 37.75 (120)
8xTITAN 20G Galvatron-Base 22.57 (160) 14.90 (136) 77.96 (1232) 52.06 (800) 28.06 (96) 16.33 (96) 73.26 (392) 47.43 (520)
8xTITAN 20G Galvatron (1F1B+Bi-obj) 22.63 (64) 11.16 (32) 91.65 (568) 51.07 (480) 26.81 (64) 11.45 (24) 76.10 (436) 51.20 (360)
8xTITAN 20G Galvatron-BMW 29.08 (256) 18.30 (232) 95.59 (592) 52.06 (800) 29.28 (152) 18.09 (128) 87.23 (512) 57.23 (456)
"""
TABLE_III = """\
16xTITAN 8G PyTorch DDP (DP) OOM OOM OOM OOM OOM OOM
16xTITAN 8G Megatron (TP) OOM OOM 16.86 (32) 10.86 (16) 11.38 (16) OOM
16xTITAN 8G PyTorch GPipe (PP) 13.79 (16) 5.88 (8) 50.70 (128) 27.96 (80) 21.45 (32) 14.95 (32)
16xTITAN 8G FSDP/ZeRO-3 (SDP) 8.95 (16) 6.12 (16) 69.48 (128) 34.92 (96) 31.63 (48) 15.94 (32)
16xTITAN 8G DeepSpeed 3D 15.24 (16) 6.43 (8) 57.14 (64) 29.92 (40) 27.97 (32) 14.03 (16)
16xTITAN 8G Galvatron (DP+TP) OOM OOM 54.43 (64) 24.56 (32) 22.37 (16) 15.21 (16)
16xTITAN 8G Galvatron (DP+PP) 13.91 (16) 5.88 (8) 68.56 (128) 35.02 (72) 33.63 (40) 18.99 (32)
16xTITAN 8G Galvatron 15.24 (16) 8.43 (16) 76.74 (128) 38.32 (88) 36.14 (48) 21.25 (32)
16xTITAN 8G Galvatron (1F1B+Bi-obj) 25.02 (88) 12.00 (64) 120.90 (544) 66.77 (384) 54.71 (72) 23.07 (48)
16xTITAN 8G Galvatron-Base 38.41 (160) 15.06 (128) 111.21 (672) 62.84 (648) 63.84 (192) 34.38 (208)
16xTITAN 8G Galvatron-BMW 42.04 (256) 20.36 (224) 139.51 (928) 78.32 (784) 94.03 (256) 56.49 (256)
16xTITAN 16G PyTorch DDP (DP) 12.14 (16) OOM 88.06 (128) OOM 43.05 (48) 10.92 (16)
16xTITAN 16G Megatron (TP) 6.12 (16) 4.23 (16) 17.11 (64) 11.26 (48) 12.53 (32) 8.00 (16)
16xTITAN 16G PyTorch GPipe (PP) 23.29 (40) 12.92 (24) 69.72 (320) 50.23 (208) 36.09 (80) 26.11 (80)
16xTITAN 16G FSDP/ZeRO-3 (SDP) 30.37 (64) 11.74 (32) 123.95 (320) 61.49 (224) 68.92 (112) 36.33 (80)
16xTITAN 16G DeepSpeed 3D 23.92 (48) 13.03 (24) 91.56 (256) 53.81 (152) 49.23 (88) 28.45 (56)
16xTITAN 16G Galvatron (DP+TP) 23.01 (32) 10.50 (16) 99.22 (160) 49.82 (96) 73.82 (80) 34.71 (48)
16xTITAN 16G Galvatron (DP+PP) 23.73 (40) 13.12 (40) 115.88 (224) 61.38 (208) 69.42 (96) 32.76 (56)
16xTITAN 16G Galvatron 32.67 (64) 14.74 (40) 131.15 (320) 72.74 (208) 73.82 (80) 40.10 (64)
16xTITAN 16G Galvatron (1F1B+Bi-obj) 49.65 (232) 22.30 (104) 167.48 (832) 100.26 (512) 92.90 (320) 68.94 (288)
16xTITAN 16G Galvatron-Base 48.66 (368) 25.11 (200) 163.92 (1376) 91.85 (904) 87.58 (384) 55.12 (288)
16xTITAN 16G Galvatron-BMW 55.57 (384) 33.14 (320) 179.89 (960) 114.08 (1136) 117.71 (400) 80.53 (448)
16xA100 8G PyTorch DDP (DP) OOM OOM OOM OOM OOM OOM
16xA100 8G Megatron (TP) OOM OOM 53.43 (32) 31.92 (16) 30.75 (16) OOM
16xA100 8G PyTorch GPipe (PP) 57.22 (16) 14.74 (8) 233.45 (128) 176.60 (80) 84.23 (32) 55.81 (32)
16xA100 8G FSDP/ZeRO-3 (SDP) 27.75 (16) 17.80 (16) 204.73 (128) 119.91 (96) 107.13 (48) 47.11 (32)
16xA100 8G DeepSpeed 3D 85.38 (16) 42.39 (8) 292.64 (64) 185.23 (40) 124.71 (32) 70.36 (16)
16xA100 8G Galvatron (DP+TP) OOM OOM 126.05 (48) 38.65 (32) 48.02 (16) 32.69 (16)
16xA100 8G Galvatron (DP+PP) 74.80 (16) 35.42 (8) 412.70 (104) 244.97 (80) 142.34 (40) 75.05 (32)
16xA100 8G Galvatron 99.17 (24) 53.38 (16) 453.87 (152) 277.94 (96) 152.71 (48) 83.86 (32)
16xA100 8G Galvatron (1F1B+Bi-obj) 162.52 (96) 81.04 (64) 572.05 (576) 407.64 (384) 216.47 (128) 93.53 (48)
16xA100 8G Galvatron-Base 140.21 (144) 94.33 (136) 576.94 (832) 369.09 (704) 227.40 (288) 151.96 (248)
16xA100 8G Galvatron-BMW 202.34 (296) 132.03 (288) 697.34 (1152) 457.74 (1056) 348.29 (416) 230.74 (384)
16xA100 16G PyTorch DDP (DP) 34.95 (16) OOM 303.26 (128) OOM 126.02 (48) 28.15 (16)
16xA100 16G Megatron (TP) 18.87 (16) 12.55 (16) 55.68 (64) 35.05 (48) 35.18 (32) 21.97 (16)
16xA100 16G PyTorch GPipe (PP) 91.10 (40) 27.42 (24) 323.95 (320) 254.12 (208) 154.53 (80) 98.55 (80)
16xA100 16G FSDP/ZeRO-3 (SDP) 113.98 (64) 38.89 (32) 514.80 (320) 274.47 (224) 212.35 (112) 107.24 (80)
16xA100 16G DeepSpeed 3D 133.67 (48) 82.25 (32) 506.17 (256) 322.73 (152) 188.74 (88) 99.94 (56)
16xA100 16G Galvatron (DP+TP) 72.37 (32) 25.65 (16) 482.42 (208) 165.92 (96) 200.28 (80) 95.48 (48)
16xA100 16G Galvatron (DP+PP) 135.48 (48) 74.95 (32) 611.15 (248) 346.13 (128) 230.16 (96) 115.55 (56)
16xA100 16G Galvatron 147.26 (64) 95.90 (40) 641.40 (352) 398.28 (232) 238.56 (96) 127.34 (72)
16xA100 16G Galvatron (1F1B+Bi-obj) 226.73 (192) 144.59 (144) 797.16 (920) 488.44 (896) 349.72 (192) 207.08 (192)
16xA100 16G Galvatron-Base 168.08 (376) 113.63 (344) 727.98 (1344) 440.82 (1152) 323.79 (440) 213.65 (400)
16xA100 16G Galvatron-BMW 243.55 (416) 161.07 (320) 871.26 (1344) 533.46 (1088) 409.47 (512) 265.37 (480)
"""
TABLE_IV = """\
64xA100 16G PyTorch DDP (DP) OOM OOM
64xA100 16G Megatron (TP) 0.68 (3) 1.94 (12)
64xA100 16G PyTorch GPipe (PP) 9.74 (16) 61.95 (96)
64xA100 16G FSDP/ZeRO-3 (SDP) OOM OOM
64xA100 16G DeepSpeed 3D 8.44 (16) 64.91 (96)
64xA100 16G Galvatron (DP+TP) 1.73 (4) 5.07 (2)
64xA100 16G Galvatron (DP+PP) 9.74 (16) 64.83 (104)
64xA100 16G Galvatron 13.77 (24) 68.35 (136)
64xA100 16G Galvatron (1F1B+Bi-obj) 19.43 (24) 109.81 (256)
64xA100 16G Galvatron-Base 25.30 (128) 130.88 (768)
64xA100 16G Galvatron-BMW 37.09 (376) 209.48 (1392)
64xA100 32G PyTorch DDP (DP) OOM OOM
64xA100 32G Megatron (TP) 0.77 (7) 2.11 (28)
64xA100 32G PyTorch GPipe (PP) 21.38 (48) 94.84 (288)
64xA100 32G FSDP/ZeRO-3 (SDP) OOM OOM
64xA100 32G DeepSpeed 3D 21.28 (40) 91.19 (256)
64xA100 32G Galvatron (DP+TP) 1.73 (4) 5.51 (68)
64xA100 32G Galvatron (DP+PP) 23.64 (48) 110.98 (232)
64xA100 32G Galvatron 27.49 (64) 114.55 (328)
64xA100 32G Galvatron (1F1B+Bi-obj) 41.11 (80) 180.08 (640)
64xA100 32G Galvatron-Base 40.17 (184) 195.40 (1024)
64xA100 32G Galvatron-BMW 60.04 (640) 330.30 (1744)
"""


def paper_cells(table: str) -> dict[tuple[str, int, str, str], tuple[float, int] | None]:
    """(cluster, budget GB, model header lower-cased, our row name) -> (samples/s, batch) or
    None (OOM), for `table` in "TABLE_II", "TABLE_III", "TABLE_IV"."""
    columns = [c.lower() for c in COLUMNS[table]]
    out: dict[tuple[str, int, str, str], tuple[float, int] | None] = {}
    for line in globals()[table].splitlines():
        cluster, budget, rest = line.split(" ", 2)
        cells = _CELL.findall(rest)
        label = rest[: rest.index(cells[0])].strip() if len(cells) == len(columns) else None
        if label not in ROW_NAMES:
            raise ValueError(f"{table}: cannot read the paper's line {line!r}")
        for model, cell in zip(columns, cells, strict=True):
            value = None
            if cell != "OOM":
                tput, batch = cell.split(" ")
                value = (float(tput), int(batch.strip("()")))
            out[(cluster, int(budget.rstrip("G")), model, ROW_NAMES[label])] = value
    return out
