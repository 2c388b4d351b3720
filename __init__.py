"""selfspec: train speculative-decoding drafters from a frozen language model and decode with them, losslessly."""
