"""A tiny OPT actor (step 1's output) and a RewardModel critic (step 2's output) with a BPE
tokenizer trained on local/jsonfile data, all built on this machine."""
import json, math, random, sys
from pathlib import Path
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModel, OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast

root = Path(sys.argv[1]); chat = Path(sys.argv[2])
sys.path.insert(0, str(chat))
from dschat.utils.model.reward_model import RewardModel

rng = random.Random(0)
words = "the quick brown fox jumps over a lazy dog while seven tiny models learn to count".split()
def sentence(n): return " ".join(rng.choice(words) for _ in range(n))
rows = [{"prompt": "Human: " + sentence(rng.randint(3, 6)) + " Assistant:", "chosen": sentence(rng.randint(3, 6)),
         "rejected": sentence(rng.randint(3, 6))} for _ in range(96)]
(chat / "data" / "train.json").write_text(json.dumps(rows[:64]))
(chat / "data" / "eval.json").write_text(json.dumps(rows[64:]))
text = [r["prompt"] + " " + r["chosen"] + " " + r["rejected"] for r in rows]
tok = Tokenizer(models.BPE()); tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False); tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>", "<pad>"],
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>", unk_token="</s>", pad_token="<pad>")
vocab = int(8 * math.ceil(len(wrapped) / 8.0))
config = OPTConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                   max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=0, eos_token_id=0)
torch.manual_seed(0)
actor = root / "actor"; OPTForCausalLM(config).save_pretrained(actor); wrapped.save_pretrained(actor)
critic = root / "critic"; critic.mkdir(parents=True, exist_ok=True)
torch.manual_seed(1)
model = RewardModel(AutoModel.from_config(config), wrapped, num_padding_at_beginning=1)
torch.save(model.state_dict(), critic / "pytorch_model.bin"); config.save_pretrained(critic); wrapped.save_pretrained(critic)
print("vocab", vocab, "tokens", len(wrapped))
