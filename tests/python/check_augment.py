"""Oracle for data.augment: applies torchvision's own operations with the
draws Limbo made and compares bit for bit.

usage: check_augment.py DIR
DIR holds case.json ({"shape": [n, C, H, W], "ops": [["random_crop", P] |
["hflip", 0], ...], "draws": [{"top", "left", "flip"}, ...]}), input.bin and
output.bin (float32, C order). Prints "ok" or what differs; exit 1 on a
difference, 77 when torchvision is missing.
"""
import json
import sys

import numpy as np

try:
    import torch
    import torchvision.transforms.functional as F
except ImportError:
    print("torchvision is not installed")
    sys.exit(77)


def main():
    d = sys.argv[1]
    case = json.load(open(f"{d}/case.json"))
    n, c, h, w = case["shape"]
    x = torch.from_numpy(np.fromfile(f"{d}/input.bin", dtype=np.float32).reshape(n, c, h, w))
    got = torch.from_numpy(np.fromfile(f"{d}/output.bin", dtype=np.float32).reshape(n, c, h, w))
    bad = []
    for i in range(n):
        img, draw = x[i], case["draws"][i]
        for name, p in case["ops"]:
            if name == "random_crop":
                # RandomCrop(size=(H, W), padding=P): pad with 0, crop at (top, left)
                img = F.crop(F.pad(img, [p], fill=0), draw["top"], draw["left"], h, w)
            elif name == "hflip" and draw["flip"]:
                img = F.hflip(img)
        if not torch.equal(img, got[i]):
            bad.append(i)
    if bad:
        print(f"samples {bad} differ from torchvision")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
