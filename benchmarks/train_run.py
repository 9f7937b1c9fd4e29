"""A real training run: a 2-layer LSTM character language model on the Zen of Python (the text
that ships with every Python, ``import this``), trained for a fixed number of steps from the
same initial weights and the same batches with rnncc.nn and with torch.nn.LSTM (cuDNN on a GPU),
IEEE float32 (TF32 off). Prints both loss curves and their largest relative gap:

    python3 benchmarks/train_run.py [--steps 300] [--device cuda] [--json out.json]
"""

import argparse
import codecs
import contextlib
import copy
import io

import torch

import rnncc.nn
from rnncc.runtime.files import write_json


def zen() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


class CharLM(torch.nn.Module):
    """Embedding (V -> 64), LSTM 64 -> 256, 2 layers, Linear (256 -> V)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 64)
        self.lstm = torch.nn.LSTM(64, 256, num_layers=2)
        self.out = torch.nn.Linear(256, vocab)

    def forward(self, x):
        y, _ = self.lstm(self.embed(x))
        return self.out(y)


def batches(text: str, steps: int, batch: int, length: int, seed: int = 0):
    """(inputs [T, N], targets [T, N]) of random windows, the same for both runs."""
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(ch) for ch in text])
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, len(ids) - length - 1, (batch,), generator=gen)
        window = torch.stack([ids[s:s + length + 1] for s in start.tolist()], dim=1)
        yield window[:-1], window[1:]


def train(model, data, device, lr=3e-3):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, target in data:
        x, target = x.to(device), target.to(device)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    text = zen()
    torch.manual_seed(0)
    theirs = CharLM(len(set(text))).to(args.device)
    ours = copy.deepcopy(theirs)
    ours.lstm = rnncc.nn.from_torch(theirs.lstm)
    curves = {name: train(model, batches(text, args.steps, args.batch, args.length),
                          args.device)
              for name, model in (("torch", theirs), ("rnncc", ours))}
    gap = max(abs(a - b) / b for a, b in zip(curves["rnncc"], curves["torch"]))
    for step in range(0, args.steps, max(1, args.steps // 10)):
        print(f"step {step:4d}  torch {curves['torch'][step]:.5f}  "
              f"rnncc {curves['rnncc'][step]:.5f}")
    print(f"final: torch {curves['torch'][-1]:.5f}, rnncc {curves['rnncc'][-1]:.5f}; largest "
          f"relative gap over {args.steps} steps: {gap:.2e} ({args.device})")
    if args.json:
        write_json(args.json, {"device": args.device, "steps": args.steps, **curves})


if __name__ == "__main__":
    main()
