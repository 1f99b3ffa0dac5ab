from steadylm.eval.harness import main

main()
