"""KVzap: KVzip's scores predicted from hidden states (`method`) by a small fitted surrogate (`surrogate`)."""
