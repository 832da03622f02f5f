import json,os,random,sys,torch
O=os.environ["OUT"];n=sys.argv[1];c=sys.argv[2] if len(sys.argv)>2 else ""
if c: torch.cuda.memory._set_allocator_settings(c)
torch.cuda.init();torch.cuda.memory._record_memory_history(enabled="all",context=None,stacks="python",max_entries=10_000_000)
def graphs():
 m=torch.nn.Sequential(torch.nn.Linear(2048,3072),torch.nn.ReLU(),torch.nn.Linear(3072,512)).cuda();L=torch.nn.MSELoss();o=torch.optim.SGD(m.parameters(),lr=.1)
 x=torch.randn(384,2048,device="cuda");y=torch.randn(384,512,device="cuda");s=torch.cuda.Stream();s.wait_stream(torch.cuda.current_stream())
 with torch.cuda.stream(s):
  for _ in range(3):o.zero_grad(set_to_none=True);L(m(x),y).backward();o.step()
 torch.cuda.current_stream().wait_stream(s);gs=[]
 for k in range(2):
  g=torch.cuda.CUDAGraph();o.zero_grad(set_to_none=True)
  with torch.cuda.graph(g,stream=s):l=L(m(x),y);l.backward();o.step()
  gs.append((g,l))
 for _ in range(3):
  for g,_ in gs:g.replay()
 torch.cuda.synchronize();del gs,g,l;o.zero_grad(set_to_none=True);torch.cuda.empty_cache();churn(9)
def churn(seed):
 k=[];r=random.Random(seed)
 for i in range(200):
  k.append(torch.empty(r.randint(1,1<<24),dtype=torch.uint8,device="cuda"))
  if len(k)>16:k.pop(r.randrange(len(k)))
 torch.cuda.synchronize()
def mempool(keep):
 r=random.Random(5);p=torch.cuda.MemPool();e,q=[],[]
 for i in range(400):
  if i%3==0:
   with torch.cuda.use_mem_pool(p):q.append(torch.empty(r.randint(1,1<<23),dtype=torch.uint8,device="cuda"))
  else:e.append(torch.empty(r.randint(1,1<<23),dtype=torch.uint8,device="cuda"))
  if len(e)>20:e.pop(r.randrange(len(e)))
  if len(q)>10:q.pop(r.randrange(len(q)))
  if keep and i==200:torch.cuda.empty_cache()
 torch.cuda.synchronize()
 if keep:globals()["K"]=(p,q[:3])
{"graphs":graphs,"mempool":lambda:mempool(0),"mempool_kept":lambda:mempool(1)}[n]()
torch.cuda.memory._dump_snapshot(f"{O}/{n}.pickle")
def sub(s):return{k:v for k,v in s.items() if k.endswith((".all.peak",".all.current",".all.allocated",".all.freed")) or k.startswith("num_")}
d=sub(torch.cuda.memory_stats(0));d["devices"]={"0":sub(torch.cuda.memory_stats(0))}
json.dump(d,open(f"{O}/{n}.stats.json","w"))
print(n,d["num_device_alloc"])
